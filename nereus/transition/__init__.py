"""nereus.transition"""
