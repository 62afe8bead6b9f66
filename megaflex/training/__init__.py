"""megaflex.training"""
