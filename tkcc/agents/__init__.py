"""Agents: proposers, the campaign loop, the experiment store, ship/revert, continual watch."""
