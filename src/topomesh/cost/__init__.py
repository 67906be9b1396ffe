"""Cost models: device specs (devices), op profiles with a roofline fallback (ops, opdb),
collective models and profiles (collectives), and cluster calibration (calibrate).

See docs/cost.md.
"""
