"""Experiment tools (imported as dpdro.simulations): sweeps, reports and plots, saved configurations."""
