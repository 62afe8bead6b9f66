"""megaflex.data"""
