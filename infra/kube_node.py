"""One label of the Kubernetes node this pod runs on, written to a file for the node agent.

The agent's `--pod` (the fabric island a node is in) is a property of the node: a label such as
`topology.kubernetes.io/zone` or a rack or NVLink-domain label. The downward API gives a pod its
own labels and its node's name, never the node's labels, so the agents' DaemonSet runs this in
an init container (infra/deploy/kubernetes/agents.yaml) with a service account that may `get`
nodes, and the agent reads the file it writes:

    python -m infra.kube_node --label topology.kubernetes.io/zone --out /run/forgeline/pod \
        --levels block=example.com/block,rack=example.com/rack \
        --topology-out /run/forgeline/topology

`--levels` maps the cluster file's levels inside a pod to node labels; the second file is then
the agent's `--topology` ("block=b1,rack=r3"), empty when no levels are given.

Standard library only: it runs before anything else of Forgeline's is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

# Where every pod finds the API server and its service account's credentials.
IN_CLUSTER_API = "https://kubernetes.default.svc"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0


class NodeLabelError(Exception):
    """The node or its label cannot be read; the message names the node, the label and the fix."""


def node_labels(node: str, api: str, token: str, ca_file: Path | None) -> dict[str, str]:
    """Every label of `node`, asked of the API server at `api`."""
    url = f"{api.rstrip('/')}/api/v1/nodes/{urllib.parse.quote(node, safe='')}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            return json.loads(response.read()).get("metadata", {}).get("labels", {})
    except urllib.error.HTTPError as err:
        hint = " (the service account needs `get` on nodes)" if err.code == 403 else ""
        raise NodeLabelError(f"node {node}: the API server answered {err.code}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise NodeLabelError(f"node {node}: cannot read it from {api} ({err})") from None


def label_value(labels: dict[str, str], node: str, label: str) -> str:
    """`label`'s value as a Forgeline name; the error says how to label the node."""
    value = labels.get(label)
    if not value:
        raise NodeLabelError(
            f"node {node} has no label {label}: label it (kubectl label node {node} "
            f"{label}=ISLAND) or set FORGELINE_POD_LABEL to a label its nodes carry"
        )
    # Forgeline's names are lowercase (workflows.contracts.names); a label value has the same
    # alphabet in either case, so the lowercased value is always a valid --pod.
    return value.lower()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="e.g. topology.kubernetes.io/zone")
    parser.add_argument("--out", type=Path, required=True, help="file to write the value to")
    parser.add_argument(
        "--node",
        default=os.environ.get("NODE_NAME", ""),
        help="default: $NODE_NAME (spec.nodeName from the downward API)",
    )
    parser.add_argument(
        "--levels",
        default="",
        help="the cluster's levels as node labels: block=example.com/block,rack=example.com/rack",
    )
    parser.add_argument("--topology-out", type=Path, help="file to write the agent's --topology to")
    parser.add_argument("--api", default=IN_CLUSTER_API)
    parser.add_argument("--service-account", type=Path, default=SERVICE_ACCOUNT)
    args = parser.parse_args(argv)
    if not args.node:
        parser.error("no node name: pass --node or set NODE_NAME from spec.nodeName")
    account: Path = args.service_account
    ca_file = account / "ca.crt"
    try:
        levels = parse_levels(args.levels)
        token = (account / "token").read_text().strip()
        labels = node_labels(args.node, args.api, token, ca_file if ca_file.is_file() else None)
        value = label_value(labels, args.node, args.label)
        position = ",".join(
            f"{level}={label_value(labels, args.node, label)}" for level, label in levels
        )
    except (NodeLabelError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(value)
    print(f"node {args.node}: {args.label}={value}")
    if args.topology_out is not None:
        args.topology_out.parent.mkdir(parents=True, exist_ok=True)
        args.topology_out.write_text(position)
        print(f"node {args.node}: topology {position or '(no levels)'}")
    return 0


def parse_levels(text: str) -> list[tuple[str, str]]:
    """ "block=example.com/block,rack=example.com/rack" as (level, label) pairs."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        level, sep, label = part.partition("=")
        if not sep or not level or not label:
            raise NodeLabelError(
                f"--levels: {part!r} is not LEVEL=LABEL: write it as "
                "block=example.com/block,rack=example.com/rack"
            )
        pairs.append((level.strip(), label.strip()))
    return pairs


if __name__ == "__main__":
    sys.exit(main())
