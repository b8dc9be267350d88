"""Resizable tensor-parallel layers, the plan they execute, and migration. Role: mechanism."""
