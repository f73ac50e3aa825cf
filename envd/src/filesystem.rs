//! `filesystem.Filesystem`: the SDK's `files.*` calls, on the sandbox's own filesystem, with
//! the requesting user's home for relative paths and as the owner of what they create.

use std::path::Path;

use crate::connect::{Code, RpcError};
use crate::files::make_dirs;
use crate::paths::Scope;
use crate::wire::{EntryInfo, EntryResponse, ListDirRequest, ListDirResponse, MoveRequest, PathRequest};

fn io_error(what: &str, err: std::io::Error) -> RpcError {
    let code = match err.kind() {
        std::io::ErrorKind::NotFound => Code::NotFound,
        std::io::ErrorKind::AlreadyExists => Code::AlreadyExists,
        std::io::ErrorKind::PermissionDenied => Code::PermissionDenied,
        _ => Code::Internal,
    };
    RpcError::new(code, format!("{what}: {err}"))
}

pub fn stat(scope: &Scope, req: PathRequest) -> Result<EntryResponse, RpcError> {
    let path = scope.resolve(&req.path)?;
    Ok(EntryResponse {
        entry: scope.entry(&path)?,
    })
}

pub fn make_dir(scope: &Scope, req: PathRequest) -> Result<EntryResponse, RpcError> {
    let path = scope.resolve(&req.path)?;
    if path.exists() {
        return Err(RpcError::new(
            Code::AlreadyExists,
            format!("{} already exists", req.path),
        ));
    }
    make_dirs(&path, scope.user).map_err(|e| io_error(&req.path, e))?;
    Ok(EntryResponse {
        entry: scope.entry(&path)?,
    })
}

pub fn rename(scope: &Scope, req: MoveRequest) -> Result<EntryResponse, RpcError> {
    let from = scope.resolve(&req.source)?;
    let to = scope.resolve(&req.destination)?;
    if !from.exists() {
        return Err(RpcError::new(Code::NotFound, format!("{} does not exist", req.source)));
    }
    if let Some(parent) = to.parent() {
        make_dirs(parent, scope.user).map_err(|e| io_error(&req.destination, e))?;
    }
    std::fs::rename(&from, &to).map_err(|e| io_error(&req.source, e))?;
    Ok(EntryResponse {
        entry: scope.entry(&to)?,
    })
}

pub fn remove(scope: &Scope, req: PathRequest) -> Result<crate::wire::Empty, RpcError> {
    let path = scope.resolve(&req.path)?;
    if path == Path::new("/") || path == scope.home() {
        return Err(RpcError::new(
            Code::PermissionDenied,
            format!("{} cannot be removed", scope.shown(&path)),
        ));
    }
    let meta = std::fs::symlink_metadata(&path).map_err(|e| io_error(&req.path, e))?;
    if meta.is_dir() {
        std::fs::remove_dir_all(&path)
    } else {
        std::fs::remove_file(&path)
    }
    .map_err(|e| io_error(&req.path, e))?;
    Ok(crate::wire::Empty {})
}

pub fn list_dir(scope: &Scope, req: ListDirRequest) -> Result<ListDirResponse, RpcError> {
    let root = scope.resolve(&req.path)?;
    let meta = std::fs::metadata(&root).map_err(|e| io_error(&req.path, e))?;
    if !meta.is_dir() {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("{} is not a directory", req.path),
        ));
    }
    let depth = req.depth.max(1);
    let mut entries = Vec::new();
    walk(scope, &root, depth, &mut entries)?;
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(ListDirResponse { entries })
}

fn walk(scope: &Scope, dir: &Path, depth: u32, out: &mut Vec<EntryInfo>) -> Result<(), RpcError> {
    for item in std::fs::read_dir(dir).map_err(|e| io_error(&dir.display().to_string(), e))? {
        let item = item.map_err(|e| io_error("listing", e))?;
        let path = item.path();
        let info = scope.entry(&path)?;
        let is_dir = info.kind == "FILE_TYPE_DIRECTORY";
        out.push(info);
        if is_dir && depth > 1 {
            walk(scope, &path, depth - 1, out)?;
        }
    }
    Ok(())
}
