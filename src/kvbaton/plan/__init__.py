"""Goodput placement search (`kvbaton plan`): DistServe's tp/pp enumeration, per-GPU goodput by simulation."""
