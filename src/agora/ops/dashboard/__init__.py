"""Live web dashboard of a run: an aiohttp server that polls the DHT and one self-contained HTML page."""

from agora.ops.dashboard.server import DashboardState, diff_events, make_app, run_dashboard

__all__ = ["DashboardState", "diff_events", "make_app", "run_dashboard"]
