"""gateway/routes"""
