"""Calling the pipeline: ``router`` (pick a peer -> call -> classify the error -> ban -> retry) and ``trainer``.

Layer: above ``net`` (transport, records, routing), below ``server``, whose stages reuse the router to reach the
next stage. See docs/ARCHITECTURE.md.
"""
