"""The Grafana dashboards' source: ``generate.py`` (the dashboards, the Kubernetes copies) over ``panels.py``."""
