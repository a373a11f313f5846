"""Compatibility layer: training aids that work under every ZeRO stage (EMA, ...)."""
