"""local_engine/models"""
