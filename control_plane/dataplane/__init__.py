"""The control plane's side of the router workers, apart from HTTP: what they serve from
(``publisher``), which of them are alive (``workers``), what they report and asking for it
(``reports``), and the global rate limits they take tokens from (``rate_grants``).  The
aiohttp routes over these are ``control_plane.admin.dataplane``."""
