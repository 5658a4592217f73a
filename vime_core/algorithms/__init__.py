"""Advantage estimators, log-prob computation and policy losses (shared by every trainer backend)."""
