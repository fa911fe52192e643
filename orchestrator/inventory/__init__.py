"""Inventory: hosts, groups and their variables from YAML, Ansible YAML and INI inventories, the
variables table and `--limit` patterns, typed past validation. Imports only core.
"""
