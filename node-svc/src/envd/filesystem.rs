//! `filesystem.Filesystem`: the SDK's `files.*` calls, confined to the sandbox's home.

use std::path::Path;

use super::connect::{Code, RpcError};
use super::paths::{entry, resolve};
use super::wire::{EntryInfo, EntryResponse, ListDirRequest, ListDirResponse, MoveRequest, PathRequest};

fn io_error(what: &str, err: std::io::Error) -> RpcError {
    let code = match err.kind() {
        std::io::ErrorKind::NotFound => Code::NotFound,
        std::io::ErrorKind::AlreadyExists => Code::AlreadyExists,
        std::io::ErrorKind::PermissionDenied => Code::PermissionDenied,
        _ => Code::Internal,
    };
    RpcError::new(code, format!("{what}: {err}"))
}

pub fn stat(home: &Path, req: PathRequest) -> Result<EntryResponse, RpcError> {
    let path = resolve(home, &req.path)?;
    Ok(EntryResponse {
        entry: entry(home, &path)?,
    })
}

pub fn make_dir(home: &Path, req: PathRequest) -> Result<EntryResponse, RpcError> {
    let path = resolve(home, &req.path)?;
    if path.exists() {
        return Err(RpcError::new(
            Code::AlreadyExists,
            format!("{} already exists", req.path),
        ));
    }
    std::fs::create_dir_all(&path).map_err(|e| io_error(&req.path, e))?;
    Ok(EntryResponse {
        entry: entry(home, &path)?,
    })
}

pub fn rename(home: &Path, req: MoveRequest) -> Result<EntryResponse, RpcError> {
    let from = resolve(home, &req.source)?;
    let to = resolve(home, &req.destination)?;
    if !from.exists() {
        return Err(RpcError::new(Code::NotFound, format!("{} does not exist", req.source)));
    }
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent).map_err(|e| io_error(&req.destination, e))?;
    }
    std::fs::rename(&from, &to).map_err(|e| io_error(&req.source, e))?;
    Ok(EntryResponse {
        entry: entry(home, &to)?,
    })
}

pub fn remove(home: &Path, req: PathRequest) -> Result<super::wire::Empty, RpcError> {
    let path = resolve(home, &req.path)?;
    if path == home {
        return Err(RpcError::new(
            Code::PermissionDenied,
            "the sandbox's home cannot be removed",
        ));
    }
    let meta = std::fs::symlink_metadata(&path).map_err(|e| io_error(&req.path, e))?;
    if meta.is_dir() {
        std::fs::remove_dir_all(&path)
    } else {
        std::fs::remove_file(&path)
    }
    .map_err(|e| io_error(&req.path, e))?;
    Ok(super::wire::Empty {})
}

pub fn list_dir(home: &Path, req: ListDirRequest) -> Result<ListDirResponse, RpcError> {
    let root = resolve(home, &req.path)?;
    let meta = std::fs::metadata(&root).map_err(|e| io_error(&req.path, e))?;
    if !meta.is_dir() {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("{} is not a directory", req.path),
        ));
    }
    let depth = req.depth.max(1);
    let mut entries = Vec::new();
    walk(home, &root, depth, &mut entries)?;
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(ListDirResponse { entries })
}

fn walk(home: &Path, dir: &Path, depth: u32, out: &mut Vec<EntryInfo>) -> Result<(), RpcError> {
    for item in std::fs::read_dir(dir).map_err(|e| io_error(&dir.display().to_string(), e))? {
        let item = item.map_err(|e| io_error("listing", e))?;
        let path = item.path();
        let info = entry(home, &path)?;
        let is_dir = info.kind == "FILE_TYPE_DIRECTORY";
        out.push(info);
        if is_dir && depth > 1 {
            walk(home, &path, depth - 1, out)?;
        }
    }
    Ok(())
}
