"""The live dashboard of the pair: `dspark dashboard`.

    metrics.py     vLLM's /metrics text -> a Scrape (pure; prometheus_client's parser)
    rates.py       two scrapes -> rates, latency windows, spec-decode acceptance (pure)
    hardware.py    GPU (NVML, when importable and present) and NVMe (sysfs hwmon) readings
    collector.py   the one thread that polls vLLM and the node agents each second, keeps a
                   bounded history and renders the JSON snapshot once for every client
    server.py      read-only HTTP server: the page, its assets, /api/v1/snapshot; token check
    cli.py         the click command, which only forwards its options to server.serve()
    static/        the page (no CDN, no network beyond this server) and the snapshot's JSON Schema
"""
