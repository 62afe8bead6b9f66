"""megaflex.parallel"""
