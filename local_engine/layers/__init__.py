"""local_engine/layers"""
