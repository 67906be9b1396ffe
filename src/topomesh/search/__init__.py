"""Search the layout space of a model on a cluster.

* :mod:`topomesh.search.space` — enumerate degrees × orders × knobs (compact numpy arrays;
  the count matches the closed formula for power-of-two worlds);
* :mod:`topomesh.search.prune` — remove layouts before any trace: divisibility and a memory
  lower bound, each pruned layout counted under its reason.
"""
