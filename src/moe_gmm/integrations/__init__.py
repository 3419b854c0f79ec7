"""Adapters to other libraries; each imports its library lazily."""
