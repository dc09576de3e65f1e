"""What the local demo sets up before any process starts: its manifest, its authority and its link plan.

``demo_manifest`` re-splits a preset into the asked number of stages (optionally dense boundaries or another
averaging scheme); ``LocalAuthority`` makes an invitation-only run out of the real key files and flags;
``plan_links`` picks how each peer's internet link is emulated (see ``docs/DEMO.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from agora.config import DENSE_RESIDUAL, Manifest, even_split, load_manifest
from agora.lab import netem


def averaging_section(spec: str) -> dict:
    """The manifest's ``averaging`` section from a command-line spec: ``powersgd``, ``powersgd,rank=8``,
    ``sparse,every=5,rho=0.1`` (unnamed settings keep their defaults; the manifest validates the result)."""
    scheme, *settings = [part.strip() for part in spec.split(",")]
    section: dict = {"scheme": scheme}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"averaging spec {spec!r}: expected SCHEME[,KEY=VALUE...], e.g. 'sparse,every=5'")
        section[key.strip()] = yaml.safe_load(value)
    return section


def demo_manifest(preset: str, stages: int, residual: Optional[str] = None,
                  averaging: Optional[str] = None, seed: Optional[int] = None,
                  overlap_rounds: Optional[bool] = None, upm_every_s: Optional[float] = None,
                  overrides: Optional[dict] = None) -> Manifest:
    """The preset re-split into ``stages``; ``residual="dense"`` turns compression off (fp32 boundaries);
    ``averaging`` sets the replicas' averaging scheme (a spec for :func:`averaging_section`); ``seed`` replaces the
    preset's (initial weights, data order, every random draw); ``overlap_rounds`` sets ``batch.overlap_rounds``;
    ``upm_every_s`` turns UPM rotations on (``security.upm.every_s``); ``overrides``: any other manifest settings
    (dotted keys, e.g. ``{"optimizer.name": "nadam"}``), applied last."""
    m = load_manifest(preset)
    if seed is not None:
        m = m.with_overrides(seed=seed)
    if overlap_rounds is not None:
        m = m.with_overrides(**{"batch.overlap_rounds": overlap_rounds})
    if averaging is not None:
        m = m.with_overrides(averaging=averaging_section(averaging))
    if upm_every_s is not None:
        m = m.with_overrides(**{"security.upm": {"every_s": upm_every_s}})
    if stages != m.n_stages:
        m = m.with_overrides(stages=even_split(m.model.n_layers, stages))
    if residual == "dense":
        m = m.with_overrides(**DENSE_RESIDUAL)
    elif residual not in (None, "subspace"):
        raise ValueError(f"residual must be 'dense' or 'subspace', got {residual!r}")
    if overrides:
        m = m.with_overrides(**overrides)
    return m


class LocalAuthority:
    """An invitation-only run on one machine: an authority key, a signed manifest, a certified key per process.

    Exercises the same files and flags a real allow-listed run uses (``agora keygen`` / ``sign-manifest`` /
    ``certify``, then ``--identity`` and ``--certificate`` on every peer), so the demo proves the path end to end.
    """

    def __init__(self, keys_dir: Path):
        from agora.trust.identity import generate_key, save_private_key

        self.dir = Path(keys_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = generate_key()
        save_private_key(self.key, self.dir / "authority.key")
        self.run_id: Optional[str] = None  # set by secure()

    def secure(self, manifest: Manifest) -> Manifest:
        from agora.trust.identity import public_key_bytes

        self.run_id = manifest.run_id
        security = {"authority": public_key_bytes(self.key).decode(), "allow_list": True}
        return manifest.with_overrides(security=security)

    def sign(self, manifest_path: Path) -> None:
        from agora.trust.credentials import write_manifest_signature

        write_manifest_signature(manifest_path, self.key)

    def credentials(self, name: str) -> list[str]:
        """``--identity/--certificate`` arguments of a fresh certified key for process ``name``."""
        from agora.trust.identity import generate_key, save_private_key
        from agora.trust.credentials import certify

        if self.run_id is None:
            raise RuntimeError("LocalAuthority.secure() must run before credentials are issued")
        key = generate_key()
        save_private_key(key, self.dir / f"{name}.key")
        certify(self.key, self.run_id, key, self.dir / f"{name}.cert")
        return ["--identity", str(self.dir / f"{name}.key"), "--certificate", str(self.dir / f"{name}.cert")]


LINK_BACKENDS = ("auto", "netns", "transport")


@dataclass(frozen=True)
class LinkPlan:
    """How the demo emulates each peer's internet link (``backend``: none, transport or netns) and why."""

    backend: str
    reason: str
    mbps: Optional[float] = None
    latency_ms: float = 0.0

    @property
    def agora_link(self) -> Optional[str]:
        """``AGORA_LINK`` for every peer: the latency always (only the transport can add it here), the rate only
        when the kernel does not already cap it."""
        rate = self.mbps if self.backend == "transport" else None
        parts = [f"{rate:g}mbit"] if rate is not None else []
        if self.latency_ms:
            parts.append(f"{self.latency_ms:g}ms")
        return ",".join(parts) or None

    def describe(self) -> str:
        """One line for the console: what is emulated, where, and why this backend."""
        if self.backend == "none":
            return "link emulation: off"
        if self.backend == "netns":
            what = (f"each peer in its own network namespace, egress capped by tc tbf at {self.mbps:g} Mbit/s "
                    f"(all traffic: tensors, DHT, averaging)")
            if self.latency_ms:
                what += f"; {self.latency_ms:g} ms latency injected in the transport (AGORA_LINK={self.agora_link})"
        else:
            what = (f"tensor RPCs throttled in each peer's transport (AGORA_LINK={self.agora_link}); "
                    f"DHT and averaging uncapped")
        return f"link emulation ({self.backend}): {what}. Why: {self.reason}"

    def as_dict(self) -> dict:
        return {"backend": self.backend, "reason": self.reason, "mbps": self.mbps, "latency_ms": self.latency_ms,
                "agora_link": self.agora_link}


def plan_links(mbps: Optional[float], latency_ms: float = 0.0, backend: str = "auto") -> LinkPlan:
    """Pick the link-emulation backend: ``netns`` whenever a rate is capped and namespaces work (``auto``),
    ``transport`` otherwise or when asked. ``backend="netns"`` fails instead of falling back, for callers (tests,
    benchmarks) whose numbers would mean something else under the other backend."""
    if backend not in LINK_BACKENDS:
        raise ValueError(f"link backend must be one of {LINK_BACKENDS}, got {backend!r}")
    if mbps is not None and mbps <= 0:
        raise ValueError(f"link_mbps must be positive, got {mbps}")
    if latency_ms < 0:
        raise ValueError(f"link_latency_ms must be non-negative, got {latency_ms}")
    if mbps is None:
        if not latency_ms:
            return LinkPlan("none", "no --link-mbps / --link-latency-ms given")
        if backend == "netns":
            raise ValueError("the netns backend caps a rate: give --link-mbps")
        return LinkPlan("transport", "latency only: the transport adds it (the kernel has no netem qdisc here); "
                                     "nothing to cap, so no namespaces", None, latency_ms)
    if backend == "transport":
        return LinkPlan("transport", "asked for (--link-backend transport)", mbps, latency_ms)
    ok, why = netem.available()
    if ok:
        return LinkPlan("netns", "running as root with network namespaces, veth, bridge and tc tbf available",
                        mbps, latency_ms)
    if backend == "netns":
        raise RuntimeError(f"--link-backend netns: network namespaces unavailable ({why})")
    return LinkPlan("transport", f"network namespaces unavailable ({why}), so the in-transport throttle is used",
                    mbps, latency_ms)
