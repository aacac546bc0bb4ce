"""The one home of tether's wire format: message schemas, the codec and the ZeroMQ endpoints.

Every role imports this package and nothing else from another role.
"""
