"""Thin Temporal adapters: unpack the input, call one domain function, heartbeat, map errors."""
