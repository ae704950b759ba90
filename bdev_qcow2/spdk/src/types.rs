//! The module's marker type, [`Qcow2Bdev`], which every generic of `ffi` is instantiated
//! with, and the names the rest of the crate uses for those instances. What the marker
//! stands for (its per-I/O context, node, channel and owner types) is bound in
//! `module.rs`, above every module that defines them, so each of those modules names the
//! marker without naming the others.

use crate::ffi;

/// The bdev module `qcow2`, as a type: `ffi`'s traits are implemented for it by the
/// modules that own each concern (`module.rs` binds the types, `channel.rs` the requests
/// and channels, `node.rs` the nodes).
#[derive(Debug)]
pub enum Qcow2Bdev {}

/// A request submitted to one of our bdevs (see [`ffi::bdev_io::BdevIo`]).
pub type BdevIo = ffi::bdev_io::BdevIo<Qcow2Bdev>;
/// A queue of our requests (see [`ffi::bdev_io::IoQueue`]).
pub type IoQueue = ffi::bdev_io::IoQueue<Qcow2Bdev>;
/// The requests of a queue that arrived (see [`ffi::bdev_io::Arrived`]).
pub type Arrived = ffi::bdev_io::Arrived<Qcow2Bdev>;
/// One step of a visit of a node's channels (see [`ffi::io_channel::ChannelIter`]).
pub type ChannelIter = ffi::io_channel::ChannelIter<Qcow2Bdev>;
/// A registered node (see [`ffi::node::Registered`]).
pub type Registered = ffi::node::Registered<Qcow2Bdev>;
/// A node whose channels are gone (see [`ffi::node::Unregistered`]).
pub type Unregistered = ffi::node::Unregistered<Qcow2Bdev>;
/// A node in teardown on its md thread (see [`ffi::node::MdNode`]).
pub type MdNode = ffi::node::MdNode<Qcow2Bdev>;
/// A metadata owner started on this thread (see [`ffi::types::OwnerBox`]).
pub type OwnerBox = ffi::types::OwnerBox<Qcow2Bdev>;
/// A node's metadata owner (see [`ffi::types::OwnerPtr`]).
pub type OwnerPtr = ffi::types::OwnerPtr<Qcow2Bdev>;
