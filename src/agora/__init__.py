"""agora: Protocol Learning — pretrain language models on a swarm of independently owned peers.

Data flows one way through the package: ``config`` (the run manifest) -> ``model`` (a Llama cut into stages)
-> ``wire`` (exact subspace compression of what crosses a stage boundary) -> ``swarm`` (peers serving stages)
-> ``trainer`` (peers feeding data into the pipeline).
"""

__version__ = "0.1.0"
