//! kvplane's policies: the five kinds as Kubernetes custom resources (group `kvplane.io`,
//! version `v1alpha1`), their validation, and rule evaluation. Pure: no clock, and no I/O but
//! [`Documents::read`] of the files it is given; the live fleet comes in through [`Fleet`].
//!
//! - [`kinds`]: `InferenceWorkerSet`, `InferencePool`, `InferenceProvider`, `InferencePolicy`,
//!   `GatewayBackend`, with kube's `CustomResource` derive ([`crds_yaml`] prints the CRDs).
//! - [`Documents`]: YAML files to objects, every problem named by file, document and field path.
//! - [`Catalog`]: a consistent set of objects ([`Catalog::problems`] says why a set is not);
//!   [`Catalog::evaluate`] decides one request.
//! - [`admit`]: objects submitted one by one (Kubernetes) to the largest consistent catalog,
//!   with the reason each refused object is refused.

mod admission;
mod catalog;
mod documents;
mod eval;
pub mod kinds;
mod limits;
mod object;

pub use admission::{Admission, Submitted, admit};
pub use catalog::{Catalog, Problem};
pub use documents::{Documents, Located, Source};
pub use eval::{
    Candidate, Evaluation, Fleet, RejectKind, Request, Target, WorkerState, target_name,
};
pub use limits::{LimitKey, MatchedLimit};
pub use object::{Kind, Object, ParseError, Spec, crds_yaml, valid_object_name};
