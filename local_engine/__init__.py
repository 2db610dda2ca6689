"""local_engine"""
