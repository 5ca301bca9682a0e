"""Mixture-of-Experts building blocks: router, stacked experts, the MoE layer."""
