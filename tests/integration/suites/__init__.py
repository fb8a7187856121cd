"""Broker-agnostic integration suites in the style of kombu's own.

Each suite needs one fixture, ``connection``: a connected kombu Connection to a
fresh broker namespace. pgq subclasses them in tests/integration/test_suites.py;
another transport could run the same ground by providing its own fixture.
"""
