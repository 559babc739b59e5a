"""Quantized communication: the wire formats of ``CommPrecisionPolicy``."""
