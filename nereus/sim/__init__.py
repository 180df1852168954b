"""nereus.sim"""
