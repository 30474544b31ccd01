"""Continuous batching: requests, the scheduling policy, the radix prefix tree and EngineService."""
