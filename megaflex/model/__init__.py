"""megaflex.model"""
