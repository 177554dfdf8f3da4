"""grpcio's own reflection and health clients against a kvplane node (argv[1]: host:port).

Reflection in the protocol's v1alpha version (what grpcio-reflection's client asks) lists the
node's services; the standard health service answers for each of them. Exits non-zero at the
first check that fails.
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

channel = grpc.insecure_channel(sys.argv[1])


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        sys.exit(1)


stub = reflection_pb2_grpc.ServerReflectionStub(channel)
answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
services = [s.name for a in answers for s in a.list_services_response.service]
for name in ["kvplane.v1.Router", "kvplane.v1.Admin"]:
    check(f"reflection v1alpha lists {name}", name in services, services)

health = health_pb2_grpc.HealthStub(channel)
for name in ["kvplane.v1.Router", "kvplane.v1.Admin", "envoy.service.ext_proc.v3.ExternalProcessor", "liveness"]:
    status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
    check(f"health of {name!r}", status == health_pb2.HealthCheckResponse.SERVING, status)
print("grpcio: all checks passed")
