"""Trace one rank's training step of the user's model under a layout (fake tensors, fake
process group, one CPU process) into records the cost models price.

* :mod:`topomesh.trace.graph` — the records (``OpRecord``, ``CollectiveRecord``): the contract with ``cost``;
* :mod:`topomesh.trace.tracer` — ``trace_step``, ``ModelSpec``, ``transformer_spec``;
* :mod:`topomesh.trace.result` — ``Trace`` (segments, ``compose``, ``events``, ``summary``);
* :mod:`topomesh.trace.convert` — graph nodes to records, FLOPs on local shapes;
* :mod:`topomesh.trace.cache` — ``TraceCache``: one trace per layout class.
"""
