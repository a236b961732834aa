"""The live dashboard of the pair: `dspark dashboard`.

    metrics.py     vLLM's /metrics text -> a Scrape (pure; prometheus_client's parser)
    rates.py       two scrapes -> rates, latency windows, spec-decode acceptance (pure)
    hardware.py    GPU (NVML, when importable and present) and NVMe (sysfs hwmon) readings
    collector.py   the one thread that polls vLLM and the node agents each second, keeps a
                   bounded history and renders the JSON snapshot once for every client
    history.py     the collector's rounds as the charts' columns (a bounded ring)
    timeline.py    the nodes' events merged in time order, each taken once, and "lost"
    agent_fields.py  an agent's answer checked and shaped for the page (memory, liveness, lines)
    server.py      read-only HTTP server: the page, its assets, /api/v1/snapshot; token check
    cli.py         the click command, which only forwards its options to server.serve()
    static/        the page (no CDN, no network beyond this server) and the snapshot's JSON Schema
"""
