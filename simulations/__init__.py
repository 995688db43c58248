"""Experiment and measurement tools (imported as dpdro.simulations): sweeps, tuning, reports and plots, the
performance bench, saved configurations. The top layer under the CLI: may import every other package."""
