"""The conversation list on the left of the chat window: New chat, rename, delete and the list's right-click menu,
the system prompt kept per conversation, Export Markdown, and the store writes that wait while another program
holds the database locked."""
from __future__ import annotations

import re
from pathlib import Path

from PySide6.QtCore import QStandardPaths, Qt
from PySide6.QtWidgets import QFileDialog, QInputDialog, QListWidgetItem, QMenu, QMessageBox

from .store import StoreLocked


class ConversationList:
    """ChatWindow's conversation list and the store writes behind it (a mixin: the window holds the store, the
    list widget, the running generation and the status line)."""

    def _conversation_menu(self, pos):
        item = self.convs.itemAt(pos)
        if item is None:
            return
        self.convs.setCurrentItem(item)
        menu = QMenu(self)
        menu.addAction(self.actions["rename"])
        menu.addAction(self.actions["delete"])
        menu.addAction(self.actions["export"])
        menu.popup(self.convs.viewport().mapToGlobal(pos))
        self._menu = menu                     # kept for the tests (and alive while it is shown)

    def _load_conversations(self):
        self.convs.clear()
        for cid, title in self.store.conversations():
            item = QListWidgetItem(title)
            item.setToolTip(title)
            item.setData(Qt.ItemDataRole.UserRole, cid)
            self.convs.addItem(item)
        if self.convs.count() == 0:
            self.new_chat()
        else:
            self.convs.setCurrentRow(0)

    def current(self) -> int:
        return self.convs.currentItem().data(Qt.ItemDataRole.UserRole)

    # -- a database another program holds locked: the change waits, the user is told in one line ----------------
    def _stored(self, write, *args) -> bool:
        """Run a store write; False when the database is locked (said in the status bar; a kept change is saved
        by the next write or the retry timer)."""
        try:
            write(*args)
            return True
        except StoreLocked as e:
            self.status.setText(str(e))
            self.retry_timer.start()
            return False

    def _retry_store(self):
        if self._stored(self.store.retry):
            self.status.setText("the conversation database is free again; every change is saved")
            self._show_conversation()

    def new_chat(self):
        try:
            cid = self.store.new_conversation()
        except StoreLocked as e:        # nothing typed yet: nothing to keep; the user clicks again
            self.status.setText(str(e))
            return
        item = QListWidgetItem("New chat")
        item.setData(Qt.ItemDataRole.UserRole, cid)
        self.convs.insertItem(0, item)
        self.convs.setCurrentRow(0)
        self.input.setFocus()

    def _item(self, cid: int) -> QListWidgetItem | None:
        for row in range(self.convs.count()):
            if self.convs.item(row).data(Qt.ItemDataRole.UserRole) == cid:
                return self.convs.item(row)
        return None

    def rename_clicked(self):
        if not self.convs.currentItem():
            return
        cid = self.current()
        title, ok = QInputDialog.getText(self, "Rename conversation", "Title:", text=self.store.title(cid))
        if ok:
            self.rename_conversation(cid, title)

    def rename_conversation(self, cid: int, title: str):
        title = " ".join(title.split())[:200]
        if not title:
            return
        self._stored(self.store.set_title, cid, title)
        item = self._item(cid)
        if item is not None:
            item.setText(title)
            item.setToolTip(title)

    def delete_clicked(self):
        if not self.convs.currentItem():
            return
        cid = self.current()
        answer = QMessageBox.question(self, "Delete conversation",
                                      f"Delete “{self.store.title(cid)}” and its messages? This cannot be undone.")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete_conversation(cid)

    def delete_conversation(self, cid: int):
        """Delete a conversation (an answer streaming into it is stopped first); the list always keeps one."""
        if self.gen is not None and self.gen_conv == cid:
            self.gen.stop()
            self._collect()
        self._stored(self.store.delete_conversation, cid)
        item = self._item(cid)
        if item is not None:
            self.convs.takeItem(self.convs.row(item))
        if self.convs.count() == 0:
            self.new_chat()
        self._show_conversation()

    def _save_system(self):
        if self.convs.currentItem():
            self._stored(self.store.set_system, self.current(), self.system.text())

    def _export_clicked(self):
        self.export_markdown()

    def export_markdown(self, path: str | None = None):
        """Write the conversation as Markdown; the dialog starts in the user's documents folder (or home) with
        the conversation's title as the file name."""
        cid = self.current()
        path = path or QFileDialog.getSaveFileName(self, "Export Markdown", str(export_folder() / file_name(
            self.store.title(cid))), "Markdown (*.md)")[0]
        if not path:
            return
        try:
            Path(path).write_text(self.store.export_markdown(cid), encoding="utf-8")
        except OSError as e:
            QMessageBox.warning(self, "Export failed", f"Cannot write {path}: {e.strerror or e}")
            return
        self.status.setText(f"exported to {path}")


def export_folder() -> Path:
    """The user's documents folder when there is one, else the home folder."""
    docs = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    return Path(docs) if docs and Path(docs).is_dir() else Path.home()


def file_name(title: str) -> str:
    """A file name from a conversation's title: characters that no file system takes become '_'."""
    name = re.sub(r'[\x00-\x1f/\\:*?"<>|]+', "_", " ".join(title.split())).strip(" .")[:80]
    return f"{name or 'chat'}.md"
