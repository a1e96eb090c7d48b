"""Helpers below every other package (standard library only): child processes and ports."""
