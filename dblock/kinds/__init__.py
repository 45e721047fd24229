"""Kinds of lock beyond the plain exclusive one, one module each."""
