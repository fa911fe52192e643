"""Report: capacity reports (text, Markdown, JSON, HTML) built from a probe and plans, formations
included; pure. Imports llama, planning and the stages below it.
"""
