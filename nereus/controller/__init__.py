"""nereus.controller"""
