"""Peers serving pipeline stages: discovery over hivemind's DHT and streamed tensor RPCs over its libp2p P2P.

``transport`` is the only module that touches hivemind's wire format (protobuf streams, tensor chunking, bf16
serialization); everything above it exchanges plain ``(metadata dict, list of tensors)`` pairs and ``RpcError``s.
"""
