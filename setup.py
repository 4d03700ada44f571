"""One installed namespace, `crucible`, laid over the folders of the tree (the rest is in pyproject.toml).

    crucible.v1        protos/crucible/v1   generated protobuf and gRPC code
    crucible.shared    shared/              the library every service imports
    crucible.ml        ml/                  the ML domain: policy, task kinds, advantages, task families
    crucible.services  services/            one package per service (`python -m crucible.services.<name>`)
    crucible.local     local/               one-machine infrastructure: local Kafka, the chDB store server
    crucible.cli       cli/                 the `crucible` command and `crucible train`
    crucible.recipes   recipes/             the shipped recipes (TOML, package data)
    crucible.dashboards dashboards/         the shipped dashboards (Grafana JSON, package data)
"""
from setuptools import find_packages, setup

FOLDERS = {
    "crucible": "protos/crucible",
    "crucible.shared": "shared",
    "crucible.ml": "ml",
    "crucible.services": "services",
    "crucible.local": "local",
    "crucible.cli": "cli",
    "crucible.recipes": "recipes",
    "crucible.dashboards": "dashboards",
}

packages = []
for name, folder in FOLDERS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder) if name != "crucible" or sub == "v1"
                          or sub.startswith("v1.")]

setup(packages=packages, package_dir=FOLDERS)
