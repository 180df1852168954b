"""nereus.runtime"""
