"""Adapters between other frameworks' checkpoint formats and ckptkit's one representation.

Installed as the import package ``ckptkit_converters``; each converter registers itself in the
``ckptkit.converters`` entry-point group and brings its framework as an optional extra. The core
package never imports this one. No converter ships yet.
"""
