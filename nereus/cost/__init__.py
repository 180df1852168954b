"""nereus.cost"""
