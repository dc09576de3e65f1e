"""Security for a permissionless swarm: traffic monitoring (``sentinel``), deliberate attacks for testing
(``attacks``), signed DHT records and allow-lists (``identity``), RPC rate limits (``ratelimit``), and the offline
SENTINEL evaluation (``evaluate``). Submodules are imported on demand; importing the package costs nothing."""
