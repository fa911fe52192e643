"""The lab: an emulated fleet of network-namespace nodes with real OpenSSH (some booting systemd),
its faults and its repair; a product feature and the tests' fixture. Imports the stages below it.
"""
