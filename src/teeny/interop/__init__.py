"""Bridges between teeny and other frameworks."""
