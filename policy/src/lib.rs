//! kvplane's policies: the five routing kinds and `AccessPolicy` as Kubernetes custom resources
//! (group `kvplane.io`, version `v1alpha1`), their validation, and rule evaluation. Pure: no clock, and no I/O but
//! [`Documents::read`] of the files it is given; the live fleet comes in through [`Fleet`].
//!
//! - [`kinds`]: `InferenceWorkerSet`, `InferencePool`, `InferenceProvider`, `InferencePolicy`,
//!   `GatewayBackend`, and `AccessPolicy` (who may call what), with kube's `CustomResource`
//!   derive ([`crds_yaml`] prints the CRDs).
//! - [`access`]: the rights an identity holds ([`Catalog::grants`]).
//! - [`Documents`]: YAML files to objects, every problem named by file, document and field path.
//! - [`Catalog`]: a consistent set of objects ([`Catalog::problems`] says why a set is not).
//! - The pure stages of a decision: [`Catalog::resolve`] (model, backend, attached policies),
//!   [`Catalog::select_rule`], [`Catalog::candidates`], [`filters`], [`objectives`], [`pick`];
//!   `kvplane-api`'s pipeline runs them in order.
//! - [`classify`]: the built-in prompt taggers (`pii`, `complexity`).
//! - [`locality`]: where targets and the asking gateway are, and the network time between.
//! - [`admit`]: objects submitted one by one (Kubernetes) to the largest consistent catalog,
//!   with the reason each refused object is refused.

pub mod access;
mod admission;
mod candidate;
mod catalog;
pub mod classify;
mod documents;
mod expansion;
pub mod filters;
pub mod kinds;
mod limits;
pub mod locality;
mod object;
pub mod objectives;
pub mod pick;
mod resolve;

pub use admission::{Admission, Refused, Submitted, admit};
pub use candidate::{
    Candidate, FilterId, Filtered, Fleet, Prediction, RejectKind, Signals, Target, WorkerState,
    target_name,
};
pub use catalog::Check;
pub use catalog::{Catalog, Problem};
pub use documents::{Documents, FileBounds, Located, Source};
pub use limits::{LimitKey, MatchedLimit};
pub use locality::{Origin, Place};
pub use object::{Kind, Object, ParseError, Spec, crds_yaml, valid_object_name};
pub use resolve::{Attached, Request, Resolved, RuleChoice, SetRef, Via};
