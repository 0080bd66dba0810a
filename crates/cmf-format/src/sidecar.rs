//! Sidecars: complete CMF files that belong to a main file (the MTP head is one).
//!
//! The main header lists each as a [`SidecarRef`] `{role, file, uid}`; the sidecar's header has
//! `sidecar_of: {role}`. Opening through [`Cmf::open_sidecar`] checks both directions: the uid the
//! main file recorded, and the role the sidecar claims.

use crate::{Cmf, CmfError, SidecarRef};

impl Cmf {
    /// Opens the sidecar with this `role`, next to this file.
    ///
    /// Refuses with [`CmfError::Sidecar`] when no sidecar has the role or this file was built
    /// from memory (it has no directory), and with [`CmfError::SidecarMismatch`] when the file
    /// found is not the one recorded: another uid, or a `sidecar_of.role` that differs. Errors
    /// opening the sidecar itself name the sidecar's path. The same mapping contract as
    /// [`Cmf::open`] applies.
    pub fn open_sidecar(&self, role: &str) -> Result<Cmf, CmfError> {
        let sidecar_err = |detail: String| CmfError::Sidecar {
            path: self.display_path().to_path_buf(),
            role: role.to_string(),
            detail,
        };
        let Some(r) = self.header().sidecar(role) else {
            let known: Vec<&str> = self
                .header()
                .sidecars
                .iter()
                .map(|s| s.role.as_str())
                .collect();
            return Err(sidecar_err(format!(
                "no sidecar has this role (roles: {known:?})"
            )));
        };
        let Some(main) = self.path() else {
            return Err(sidecar_err(
                "an in-memory file has no directory to find sidecars in".into(),
            ));
        };
        let dir = main.parent().unwrap_or(std::path::Path::new(""));
        let path = dir.join(&r.file);
        let side = Cmf::open(&path)?;
        check_sidecar(r, &side)?;
        Ok(side)
    }
}

/// Checks that `side` is the sidecar `r` records.
pub fn check_sidecar(r: &SidecarRef, side: &Cmf) -> Result<(), CmfError> {
    let mismatch = |field, expected: String, found: String| CmfError::SidecarMismatch {
        path: side.display_path().to_path_buf(),
        role: r.role.clone(),
        field,
        expected,
        found,
    };
    if side.uid() != r.uid {
        return Err(mismatch(
            "uid",
            format!("{:016x}", r.uid),
            format!("{:016x}", side.uid()),
        ));
    }
    match &side.header().sidecar_of {
        Some(of) if of.role == r.role => Ok(()),
        Some(of) => Err(mismatch(
            "sidecar_of.role",
            format!("{:?}", r.role),
            format!("{:?}", of.role),
        )),
        None => Err(mismatch(
            "sidecar_of.role",
            format!("{:?}", r.role),
            "absent (a main file)".into(),
        )),
    }
}

impl SidecarRef {
    /// The reference a main file should record for `side`, found at `file` relative to the main
    /// file's directory. Fails if `side` is not a sidecar of this `role`.
    pub fn to(
        role: impl Into<String>,
        file: impl Into<String>,
        side: &Cmf,
    ) -> Result<SidecarRef, CmfError> {
        let r = SidecarRef {
            role: role.into(),
            file: file.into(),
            uid: side.uid(),
        };
        check_sidecar(&r, side)?;
        Ok(r)
    }
}
