"""local_engine/kernels"""
